"""The chaos soak (``orchestrator chaos``): a local deployment of real processes (:mod:`.deployment`),
a random workload and the operator's action mix (:mod:`.workload`, :mod:`.mix`), faults dealt at
random times (:mod:`.faults`), and the driver that runs them together and checks the promise from
the database at the end (:mod:`.soak`)."""

from .deployment import ROOT, PrivatePostgres, Relays, libfaketime, skewed_env
from .faults import KINDS
from .soak import run_chaos

__all__ = ["KINDS", "ROOT", "PrivatePostgres", "Relays", "libfaketime", "run_chaos", "skewed_env"]
