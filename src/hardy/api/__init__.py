"""What users call: `Pipeline` (run, map, imap, bind, visualize), pipelines nested as nodes, an item
run again under pdb, Ctrl-C's exit code. The top of the runtime: it stands on the engine."""
