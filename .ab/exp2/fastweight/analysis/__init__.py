"""Analysis of mechanisms and trained models: transition spectra over a sequence, state norms
over time, the attention map of a trained model's layers, accuracy against length and width.
``fastweight plot`` draws them (``fastweight/plot.py``)."""

from fastweight.analysis.attention import layer_attention_maps, recorded_recurrences, recurrence_attention_map
from fastweight.analysis.curves import accuracy_by_length, accuracy_by_width
from fastweight.analysis.spectra import sample_spectra, transition_spectra
from fastweight.analysis.state_norms import model_state_norms, sample_state_norms, state_norms

__all__ = ["accuracy_by_length", "accuracy_by_width", "layer_attention_maps", "model_state_norms",
           "recorded_recurrences", "recurrence_attention_map", "sample_spectra", "sample_state_norms", "state_norms",
           "transition_spectra"]
