"""A client process that queues calls to a replicated service, then waits to be killed
(``test_replicated_failures.py``): ``python caller_process.py <scheduler> <handle file>
<endpoint> <calls> <seconds>``; an endpoint ``stream:<name>`` opens streams instead."""

from __future__ import annotations

import pickle
import sys
import threading

from distributed import Client

if __name__ == "__main__":
    address, handle_file, endpoint, calls, seconds = sys.argv[1:]
    client = Client(address)
    with open(handle_file, "rb") as f:
        svc = pickle.load(f)
    if endpoint.startswith("stream:"):  # streams, each read by a thread of its own
        stream = getattr(svc, endpoint[len("stream:"):]).stream
        for _ in range(int(calls)):
            threading.Thread(target=lambda: next(iter(stream(float(seconds)))),
                             daemon=True).start()
    else:
        pending = [getattr(svc, endpoint).route(float(seconds)) for _ in range(int(calls))]
    print("sent", flush=True)
    threading.Event().wait()  # until killed
