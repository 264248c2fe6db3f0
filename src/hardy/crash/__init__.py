"""A worker's death, from the fault record it leaves to the sentence the user reads.

The walk, top-down (each step calls only the ones below it; nothing climbs back). On a death the
worker pool enters this package from `workers/deaths.py` alone, at the arrows marked ►, and asks;
it decides nothing about a death itself. (Before a timeout's kill, `Worker.kill` takes the hung
worker's stacks, `stacks.hang_stacks`, for step 6.)

    worker, dying                                  parent
    handler.py (native_handler.c) ─┐
    workers/replies.py, last words:├─► fault ─►    1. workers/deaths.Deaths.on_death(w) / .while_idle(w)
      mapped.record, record.*_line │   record         │ which item, which step (status words: doing.py)
    faulthandler ──────────────────┘   (a memfd)      │
                                                      ├─► 2. autopsy.ended ─► 3. record.read: FaultRecord
                                                      ├─► 4. blame.elsewhere: a thread the work did not start
                                                      │      (its warning: 6)
                                                      ├─► 5. by what the worker was doing: verdict.charge
                                                      │      (an item's node), verdict.split (a batched call),
                                                      │      verdict.opening (an input), verdict.between_items
                                                      │      and .reseal (a chunk, the pipeline, results),
                                                      │      blame.after_return (outside any item);
                                                      │      the thread an item died in: blame.thread_clause
                                                      │      └─► 6. autopsy.examine: frames, sentence, diagnosis
                                                      └── 7. Deaths applies the answers: the errors
                                                             (hardy.errors) to the results sink, the
                                                             innocent items to the queues, a new worker

0. In the worker (its side of the record): the native handler (`handler.py`, compiled from
   `native_handler.c`) writes the crashing thread's return addresses; the worker's last words,
   run through `signals.on_fatal_signal`, add which file each library was mapped from
   (`mapped.record`), the chain of nested plans and the thread it died in (`lines.nesting_line`,
   `lines.thread_line`, which notes what the status words said as the thread started: `doing`);
   faulthandler writes every thread's Python stack.
1. `workers/deaths.Deaths.on_death` (`while_idle` for a worker that died with nothing to do): the
   pool's bookkeeping: which item was in flight, what it had sent; it passes what it knows to this
   package and applies the answers (7). The queues are its own; the decisions are here.
2. `autopsy.ended`: how the worker ended (`sentence.describe_exit`, or why the parent killed it).
3. `record.read`: the fault record, opened once and parsed into a `FaultRecord` (Python stacks,
   nesting chain, thread, exit, native frames). Nothing after this opens the file.
4. `blame.elsewhere`: a death in a Python thread the work in flight did not start: its items run
   again, none blamed, with a warning that names the thread and who started it, up to
   `blame.MAX_THREAD_RERUNS` times for one item, which is then charged (5).
5. What the death means for the item it holds, by what the worker was doing: `verdict.charge` for
   an item in a node (its error; it fails, runs again on its node's retries, or runs again with a
   nested map's inner item failed; the thread it died in, `blame.thread_clause`), `verdict.split`
   for a batched call (the batch runs again one item per call), `verdict.opening` for a sealed
   item's input, `verdict.between_items` for a chunk, the pipeline or a batch of results (sent
   again sealed, `verdict.reseal`, or failed), `blame.after_return` for a death outside any item
   (what to add to the warning).
6. `autopsy.examine`: the record's native frames named (`frames`, `symbols`, `mapped`), the first
   line (`sentence.crash_line`: signal, library, function, the node's line), the hazards it shows
   (`diagnosis`); for a hang, the stacks taken before the kill (`stacks.hang_stacks`).
7. `NodeCrashed` / `NodeTimeout` / `ShippingError` (`hardy.errors`) carry it all; their message is
   the user's. `Deaths` applies the verdicts: the results sink fails or retries an item, the map's
   queues take back the innocent ones, the pool replaces the worker.

`hardy replay --py-spy` and `hardy repeat` read a child's stderr, where the same handler writes
the same lines, into the same `FaultRecord` (`record.from_stderr`, `sentence.crash_report`).
`kept.py` keeps failed items' inputs beside a run report for `hardy replay`; `containment.py`
holds what runs inside a worker (nested plans run there, and the inner items to fail);
`signals.py` also names the node and item of a crash of this very process during an in-process map.
"""
