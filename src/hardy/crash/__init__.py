"""Native crash forensics: which library and function a worker crashed or hung in, and why.

- `handler`: the fatal-signal handler workers install in front of faulthandler's (return addresses
  as library + offset, written to the crash record the parent reads);
- `symbols`: the parent names those offsets from each library's symbol table (C++ demangled);
- `stacks`: every thread's Python + native stack of a hung worker (py-spy, else faulthandler);
- `diagnosis`: the hazards hardy knows, matched against those frames;
- `kept`: the inputs of failed items, kept beside a run report for `hardy replay` (`cli/replay.py`).
"""
