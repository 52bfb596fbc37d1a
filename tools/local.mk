## tools/local.mk - sources of tools/ (filled in by its issue)
