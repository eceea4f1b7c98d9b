"""Run as `python _flood.py PORT RATE`: open RATE connections a second to a worker
server, each sending one request without an API key and then holding the connection
idle, until killed. Prints `flooding` once the first connection was answered."""

from __future__ import annotations

import collections
import socket
import sys
import time

REQUEST = b"GET /weights_status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def main(port: int, rate: float) -> None:
    held: collections.deque[socket.socket] = collections.deque()
    announced = False
    due = time.monotonic()
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=2)
            held.append(sock)
            sock.sendall(REQUEST)
            sock.recv(4096)
        except OSError:
            pass
        if not announced:
            print("flooding", flush=True)
            announced = True
        while len(held) > 2000:
            held.popleft().close()
        due += 1 / rate
        time.sleep(max(0.0, due - time.monotonic()))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
