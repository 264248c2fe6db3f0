"""Drop-in modules for code written against other pipeline frameworks."""
