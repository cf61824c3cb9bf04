"""Experts implementations, one file each."""
from jmoe.experts.reference import ReferenceExperts
from jmoe.experts.xla import XlaExperts
from jmoe.experts.xla_batched import XlaBatchedExperts

__all__ = ["ReferenceExperts", "XlaExperts", "XlaBatchedExperts"]
