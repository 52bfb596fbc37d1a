## tier/local.mk - sources of tier/ (filled in by its issue)
