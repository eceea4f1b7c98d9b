"""`asyncwt bench --cluster`: scaling on an emulated cluster, next to the link's ideal.

Every host is a network namespace joined to the others by a bridge (`hosts`), each
link capped both ways by the kernel's token bucket. Trainer ranks (`rank`) and
`asyncwt worker` processes run in their hosts; `run` sequences the scenarios (N
workers from one trainer, M FSDP2 ranks to M workers, at each link rate), `report`
writes the table, the JSON and the chart, `cli` is the command line, `signals` makes
every signal unwind through the cleanup.
"""

from .cli import main as main
from .run import ClusterSettings as ClusterSettings
from .run import run_cluster as run_cluster

__all__ = ["ClusterSettings", "main", "run_cluster"]
