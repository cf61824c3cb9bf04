"""Local (single-rank) PrepareFinalize implementations; the expert-parallel ones live in
`sharding/`."""
from jmoe.prepare_finalize.no_ep import NoEP, NoEPBatched

__all__ = ["NoEP", "NoEPBatched"]
