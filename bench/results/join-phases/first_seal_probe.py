"""A process's first sealed record after its TLS listener warmed up (BENCHMARKS.md section 8).

    python bench/results/join-phases/first_seal_probe.py

Without the warm-up's sealed records, the first record a process seals took 0.84 ms (the
cipher's first fetch in OpenSSL) against ~0.02 ms for later ones; after it, ~0.10 ms.
"""

import socket
import time

from recover.trainer.sealed import SealedSocket, new_key
from recover.trainer.transfer import Listener

listener = Listener("127.0.0.1", tls=True)
assert listener.warmed.wait(10)
ours, theirs = socket.socketpair()
began = time.perf_counter()
SealedSocket(ours, new_key(), donor=True).sendall(bytearray(65536))
print(f"first seal after the warm-up: {(time.perf_counter() - began) * 1e3:.3f} ms")
