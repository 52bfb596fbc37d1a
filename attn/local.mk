## attn/local.mk - sources of attn/ (filled in by its issue)
