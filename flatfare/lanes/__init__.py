"""The lane queue: how a job waits for a worker, in Redis, written in one room.

Every script that touches the queue's keys is here, each beside its thin call and its KEYS/ARGV
layout, and each self-contained (no module splices Lua into another's script):

- :mod:`.admit`: ``admit`` (the one admission script: the daily quota and the key's, the requests in
  flight, the lane's bound, the job on its account's queue or a worker's own stream, one atomic round
  trip) and ``withdraw`` (a job no worker took yet taken back). Called by the gateway.
- :mod:`.claim`: ``claim_pass`` (a worker's own stream, then premium, then standard with its share,
  one job per account in turn, then the batch lane with spare slots). Called by the workers.
- :mod:`.depth`: ``pool_queues`` (what waits for a pool's workers, and its demand). Called by the
  gateway's metrics, the admin console and the fleet supervisor.
- :mod:`.feed`: ``batch_room`` and ``feed`` (Batch API lines straight onto a pool's batch lane while
  its live lanes have nothing waiting). Called by the batch dispatcher.

The keys are the contract's (:mod:`flatfare.contract`); what the lanes mean to each side (backpressure
and refusals at the gateway, leases and takeovers at the worker) stays with that side.
"""
