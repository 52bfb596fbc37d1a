## moe/local.mk - sources of moe/ (filled in by its issue)
