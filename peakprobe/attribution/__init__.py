"""How much loss each softmax holds back: d loss / d log beta, the model under per-head inverse
temperatures, and the optimal-temperature gain search (``attribute``).

Modules: ``beta`` (attention with a per-head beta on the logits), ``tempered`` (the model under
per-layer betas, and the block cache the evaluations reuse), ``search`` (the 1-D searches over
log beta, pure Python), ``gains`` (``attribute``: every site's metrics over a few evaluation windows).
Its settings are ``peakprobe.config.AttributionConfig``.
"""

from .gains import attribute
from .search import describe_attribution

__all__ = ["attribute", "describe_attribution"]
