"""Freed host memory kept for the next step (trainer/memory.py): a buffer as large as a
step's reduction copies, freed and allocated again, is served from pages already touched
(counted as page faults, not timed), unless the worker opts out."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from recover.trainer.memory import OPT_OUT, keep_freed_memory

# In a process of its own: mallopt changes the whole process's allocator.
PROBE = """
import resource, sys, torch
from recover.trainer.memory import keep_freed_memory
print(keep_freed_memory(), file=sys.stderr)
n = 64 << 20  # bytes: above glibc's largest mmap threshold (32 MiB)
for step in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.ones(n // 8, dtype=torch.float64)  # allocated, touched, freed
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del buffer
"""


def faults(opt_out: bool) -> tuple[list[int], str]:
    """Page faults of each of 30 steps that allocate, touch and free one 64 MiB buffer."""
    env = {k: v for k, v in os.environ.items()  # whatever the run itself was told
           if k != OPT_OUT and k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    if opt_out:
        env[OPT_OUT] = "system"
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          check=True, env=env, timeout=120)
    return [int(line) for line in done.stdout.split()], done.stderr


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_freed_step_buffer_is_reused_with_its_pages_unless_the_worker_opts_out() -> None:
    # 64 MiB is 16,384 pages: allocated afresh, each faults once when touched. Kept, the
    # heap grows for the first steps (a freed block sits below small allocations made
    # after it, one alignment short of the next request) until freed blocks merge: from
    # then on every step reuses one (8-10 steps here; the last 5 of 30 are checked).
    kept, told = faults(opt_out=False)
    assert "keeps freed blocks for the next step" in told
    assert max(kept[-5:]) < 1000, kept
    fresh, told = faults(opt_out=True)
    assert f"{OPT_OUT}=system" in told
    assert min(fresh[-5:]) > 16000, fresh


def test_the_opt_out_and_the_user_s_own_malloc_settings_are_left_alone() -> None:
    assert keep_freed_memory({OPT_OUT: "system"}) == \
        f"malloc left at the C library's defaults ({OPT_OUT}=system)"
    assert keep_freed_memory({"MALLOC_ARENA_MAX": "2"}) == \
        "malloc left as the environment sets it (MALLOC_ARENA_MAX)"
    assert keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) == \
        "malloc left as the environment sets it (GLIBC_TUNABLES)"
    # (Not asked here with none of those set: that would change this process's allocator.)
