## core/local.mk - sources of core/ (filled in by its issue)
