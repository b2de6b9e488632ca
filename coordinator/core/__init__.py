"""The torch-free core: what the coordinator decides with and the workers compute with.

The only part of ``coordinator`` (with ``coordinator.control.client``) that ``worker``
imports. It imports nothing of the other subpackages.
"""
