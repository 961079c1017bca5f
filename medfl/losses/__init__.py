"""Loss functions of medfl's methods (FedSKD's similarity distillation)."""

from medfl.losses.skd import SKD_TERMS, RegionMasks, region_masks, skd_loss

__all__ = ["SKD_TERMS", "RegionMasks", "region_masks", "skd_loss"]
