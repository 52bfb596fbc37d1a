## loss/local.mk - sources of loss/ (filled in by its issue)
