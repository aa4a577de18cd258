"""sudu on Ray Serve (docs/cluster.md): `sudu serve --replicas N`. One engine per Serve replica
(replica.py), a Ray Serve request router that sends each request where its prefix is cached
(router.py, over the summaries in cache_view.py), and the OpenAI app as the ingress, driving the
replicas through a DeploymentHandle (engine.py; put together in serve.py). serve.py imports Ray only
when replicas start, so plain `sudu serve` never does."""
