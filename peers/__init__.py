"""Local multi-peer simulation: launch real `collab join` peers on one machine and report on them."""
