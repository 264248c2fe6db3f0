"""A worker's death, from the fault record it leaves to the sentence the user reads.

The walk, top-down (each step calls only the ones below it; nothing climbs back):

    worker, dying                                    parent
    handler.py (native_handler.c) ─┐
    workers/replies.py, last words:├─► fault record ─► 1. workers/deaths.Deaths.on_death
      mapped.record, record.*_line │   (a memfd)          │ which item, which step (status words)
    faulthandler ──────────────────┘                      ├─► 2. autopsy.ended ─► 3. record.read
                                                          │      the file opened once: FaultRecord
                                                          └─► 4. verdict.charge
                                                                 ├─► 5. autopsy.examine
                                                                 │      ├ record.frames (frames, symbols)
                                                                 │      ├ sentence.crash_line
                                                                 │      └ diagnosis.diagnose
                                                                 └─► 6. NodeCrashed (hardy.errors)
                                                          7. Deaths applies the Verdict: fail, retry,
                                                             or run again without a nested inner item

0. In the worker (its side of the record): the native handler (`handler.py`, compiled from
   `native_handler.c`) writes the crashing thread's return addresses; the worker's last words,
   run through `signals.on_fatal_signal`, add which file each library was mapped from
   (`mapped.record`), the chain of nested plans and the thread it died in (`record.nesting_line`,
   `record.thread_line`); faulthandler writes every thread's Python stack.
1. `workers/deaths.Deaths.on_death`: the pool's bookkeeping: which item was in flight, what it
   had sent; then it asks this package, passing what it knows, and applies the answer (7).
2. `autopsy.ended`: how the worker ended (`sentence.describe_exit`, or why the parent killed it).
3. `record.read`: the fault record, opened once and parsed into a `FaultRecord` (Python stacks,
   nesting chain, thread, exit, native frames). Nothing after this opens the file.
4. `verdict.charge`: what the death means for the item in flight: the error, and whether the item
   fails, runs again (its node's retries) or runs again with a nested map's inner item failed.
5. `autopsy.examine`: the record's native frames named (`frames`, `symbols`, `mapped`), the first
   line (`sentence.crash_line`: signal, library, function, the node's line), the hazards it shows
   (`diagnosis`); for a hang, the stacks taken before the kill (`stacks.hang_stacks`).
6. `NodeCrashed` / `NodeTimeout` (`hardy.errors`) carry it all; their message is the user's.

`hardy replay --py-spy` and `hardy repeat` read a child's stderr, where the same handler writes
the same lines, into the same `FaultRecord` (`record.from_stderr`, `sentence.crash_report`).
`kept.py` keeps failed items' inputs beside a run report for `hardy replay`; `containment.py`
holds what runs inside a worker (nested plans run there, and the inner items to fail);
`signals.py` also names the node and item of a crash of this very process during an in-process map.
"""
