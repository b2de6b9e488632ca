"""The elastic session: a worker's life in a coordinator's job, above the engine.

What the sessions move (the live exchange, the replicas, the restore plan) is the
library under the engine, worker/live/; the modules here import it and the engine,
and nothing under the engine imports them.

The modules, bottom up (each imports only those above it in this list):
* prepared.py: a membership change a member prepares for while it trains (a
  scale-up, a leave) and the buffers it writes ahead for it;
* phases.py: the session's phases and their transitions ([Note: session phases]),
  the sub-states a member keeps, :class:`PeerLost`, and the :class:`Session` the
  modules below take;
* blocks.py: a job of ep or cp groups changing by whole groups, the experts' side
  ([Note: elastic expert parallelism]);
* change.py: the prepared change made: scale-up, hand-over, a leave with nobody
  to hand over to;
* recovery.py: forming the next generation after a loss and restoring from the
  plan's source (one function per source, for every layout);
* joining.py: registering, building ahead, the first exchange;
* rings.py: the same for an engine on a mesh (tp, pp), ring by ring: joining,
  the world's vote, a leave, the switch to the next generation, standing by;
* session.py: :class:`ElasticSession`, the one elastic session of every layout:
  the engine's seams, dispatching to those.

The package's own namespace is empty: the session is
``worker.elastic.session.ElasticSession``.
"""
