"""`cullama serve --replicas N`: copies of the server on a Ray cluster, one model on one GPU each (the `ray` extra:
Ray Serve places them on the cluster's GPUs, checks their health, replaces the dead and scales on load), behind one
address. Above server/ (each replica serves server/'s app) and below cli/.

    app.py         the Ray Serve application: the deployment (one replica: one engine, create_app's app), its
                   options (capacity, health, autoscaling), application() and build_app() for Ray apps of your own
    relay.py       the public address: each request to the replica holding the fewest of this relay's requests,
                   streamed through as it comes; a replica that dies mid-stream ends the stream with an error event
    front.py       the relay's HTTP/1.1 server (asyncio and httptools): the clients' connections, malformed HTTP, stop
    prometheus.py  /metrics of all the replicas: summed (one server's names and labels), or labelled by replica
    launch.py      the process: check, listen, start or join the cluster, deploy, relay, stop on SIGINT/SIGTERM
The relay, its front and the metrics import nothing of Ray's; app.py and launch.py need it.
"""

DEPLOYMENT = "cullama"  # the deployment's name inside its Serve application
