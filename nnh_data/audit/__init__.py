"""Checking that a loop consumed every sample exactly once: :class:`EpochAudit`
(:mod:`.epoch_audit`) over a mergeable sketch of sample ids (:mod:`.id_sketch`)."""

from nnh_data.audit.epoch_audit import AuditReport, EpochAudit, RankAudit
from nnh_data.errors import ExactlyOnceError

__all__ = [
    "AuditReport",
    "EpochAudit",
    "ExactlyOnceError",
    "RankAudit",
]
