"""fastweight: the linear-attention family as fast weights.

The state S_t in R^{K x V} is a linear regression model trained online while the
sequence is read; every mechanism is one objective plus one gradient step and one
instance of the diagonal-plus-low-rank (DPLR) recurrence

    S_t = (Diag(w_t) + a_t b_t^T) S_{t-1} + k_t v_t^T,     o_t = S_t^T (scale q_t).
"""

__version__ = "0.1.0"
