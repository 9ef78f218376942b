"""`torchtpu-embedding-bench`: SparseCore embedding tables on tpu against FBGEMM, torch and TorchRec.

`options` (the command line, checked), `workload` (tables, batches, SparseCore limits),
`systems` (the four stacks under test), `measure` (interleaved timing, compiles, gather
bandwidth), `runner` (one benchmark point), `report` (table, JSON, CSV, plot), `cli` (the script).
"""
