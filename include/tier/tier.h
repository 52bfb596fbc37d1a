/* tier.h - the whole public API of libtier: include this one header. */
#ifndef TIER_TIER_H
#define TIER_TIER_H
#include "tier/base.h"
#include "tier/offload.h"
#include "tier/store.h"
#include "tier/cache.h"
#include "tier/stats.h"
#include "tier/moe.h"
#include "tier/loss.h"
#include "tier/attn.h"
#include "tier/formats.h"
#include "tier/model.h"
#include "tier/plan.h"
#endif
