"""The memory planner: what a model needs for inference or a training step, from its
``config.json`` alone (``modelspec``: the model's facts; ``memory``: the arithmetic).

May import: ``lct.arch`` (the model built from the config), ``lct.hub`` (a Hub id's config),
``lct.io``, ``lct.format`` and the leaves.
"""

from lct.plan.memory import Plan, plan
from lct.plan.options import PlanOptions

__all__ = ["Plan", "PlanOptions", "plan"]
