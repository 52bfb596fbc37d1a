/* tier.h - the whole public API of libtier: include this one header. */
#ifndef TIER_TIER_H
#define TIER_TIER_H
#include "tier/base.h"
#endif
