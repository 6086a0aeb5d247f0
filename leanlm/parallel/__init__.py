"""Work split over more than one engine: data-parallel replicas behind a cache-aware router (router.py,
replicas.py, front.py)."""
