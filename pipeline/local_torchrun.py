"""torchrun for the ranks of one machine, listening on loopback only: `python -m pipeline.local_torchrun ARGS`.

torchrun's store (a TCPStore) listens on every interface whatever address it is given, and `--standalone`
adds a second one. Here one static rendezvous at 127.0.0.1 whose store serves a socket bound to loopback
before torchrun starts, and gloo and NCCL on the loopback interface unless the environment names another.
"""

from __future__ import annotations

import os
import socket
import sys

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
from torch.distributed.run import main as torchrun

LOOPBACK = "127.0.0.1"


def loopback_store_factory(listener: socket.socket):
    """The static rendezvous's TCPStore, its server on `listener` (bound to loopback) instead of on all interfaces."""

    def create(host_name, port, world_size=None, is_master=False, *args, **kwargs) -> TCPStore:
        if is_master:
            kwargs["master_listen_fd"] = listener.detach()
        return TCPStore(host_name, port, world_size, is_master, *args, **kwargs)

    return create


def main(argv: list[str]) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    listener = socket.create_server((LOOPBACK, 0))  # held from here on: no other process can take the port
    static_tcp_rendezvous.TCPStore = loopback_store_factory(listener)
    port = listener.getsockname()[1]
    torchrun(["--nnodes=1", "--node-rank=0", f"--master-addr={LOOPBACK}", f"--master-port={port}", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
