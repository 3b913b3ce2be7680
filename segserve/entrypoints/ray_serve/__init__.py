"""``segserve serve --num-replicas N``: N engine replicas as Ray Serve deployments behind one ingress.

Only ``settings`` is imported without Ray; every other module here imports it. See ``launch`` for the
picture (driver-side ingress, ``EngineReplica`` deployment, request routers, metrics board).
"""
