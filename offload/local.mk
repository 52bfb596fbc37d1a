## offload/local.mk - sources of offload/ (filled in by its issue)
