"""`asyncwt bench`: how fast, how overlapped and how lean a weight transfer is.

Trainer and worker run in separate processes on a synthetic Llama-like model
(`_model`). One run measures, each figure the median of several rounds after a
warm-up, and each also as a ratio against a baseline of the same run:

1. limits (`_limits`): raw loopback TCP and single-thread memcpy;
2. peer approaches (`_peers`): naive per-tensor send, per-tensor gloo broadcast,
   packed-but-sequential;
3. asyncwt on every available backend (`_engines`), against a real
   `asyncwt worker` process, bit-exactness checked;
4. overlap (`_overlap`): a slow gathering source and a slow worker transform;
5. peak extra memory on both sides (`_memory`);
6. a bucket size × buffer count sweep.

`_run` sequences the sections, `_report` derives ratios, PASS/FAIL bars, the
table, the JSON and the chart; `_cli` is the command line.
"""

from ._cli import main as main
from ._run import BenchSettings as BenchSettings
from ._run import run_bench as run_bench

__all__ = ["BenchSettings", "main", "run_bench"]
