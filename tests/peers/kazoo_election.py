"""A replica that elects with kazoo's Election recipe, as Python services beside ZooKeeper do.
Prints "LEADING" when it leads. For the ZooKeeper peers benchmark
(tests/benches/zookeeper_peers.rs); Debian's python3-kazoo.

python3 kazoo_election.py CONNECT SESSION_S PATH ID
"""

import sys
import threading

from kazoo.client import KazooClient


def main():
    connect, session, path, identity = sys.argv[1:5]
    client = KazooClient(hosts=connect, timeout=float(session))
    client.start()

    def lead():
        print("LEADING", flush=True)
        threading.Event().wait()

    client.Election(path, identity).run(lead)


if __name__ == "__main__":
    main()
