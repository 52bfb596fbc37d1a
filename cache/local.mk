## cache/local.mk - sources of cache/ (filled in by its issue)
