"""Eviction policies behind one interface, chosen by name from a registry.

Every module in this package registers its policies on import; ``make_policy``
imports them all, so a new policy is a new file and nothing else.
"""

from kvstore.eviction.base import (
    Admission,
    CapacityCache,
    EvictionPolicy,
    make_policy,
    policy_names,
    register_policy,
)

__all__ = ["Admission", "CapacityCache", "EvictionPolicy", "make_policy", "policy_names",
           "register_policy"]
