"""Workloads that ship with ReCoVer; each uses only the public `recover.trainer` API."""
