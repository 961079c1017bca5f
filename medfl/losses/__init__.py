"""Loss functions of medfl's methods: FedSKD's similarity distillation, PFedCDP's
classifier KD, supervised contrastive loss and multi-teacher distillation, and FedTPF's
feature-distillation terms (:mod:`medfl.losses.feature_distill`)."""

from medfl.losses.distill import ensemble_logits, kd_loss, kl_to_teacher, sup_mtkd_loss, supcon_loss
from medfl.losses.skd import SKD_TERMS, RegionMasks, region_masks, skd_loss

__all__ = ["SKD_TERMS", "RegionMasks", "region_masks", "skd_loss", "kd_loss", "kl_to_teacher", "supcon_loss",
           "sup_mtkd_loss", "ensemble_logits"]
