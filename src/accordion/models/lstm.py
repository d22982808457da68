"""Word-level LSTM language model used for WikiText-2 in the Accordion paper.

Follows the PyTorch ``word_language_model`` example: embedding -> dropout -> multi-layer LSTM
-> dropout -> linear decoder, with the decoder weight tied to the embedding weight.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["WIKITEXT2_VOCAB_SIZE", "LSTMLanguageModel"]

WIKITEXT2_VOCAB_SIZE = 33278
"""Vocabulary size of WikiText-2 (word level, including ``<eos>``)."""

Hidden = tuple[Tensor, Tensor]


class LSTMLanguageModel(nn.Module):
    """Embedding + stacked LSTM + (tied) linear decoder; inputs are ``[seq, batch]`` tokens."""

    def __init__(
        self,
        ntoken: int = WIKITEXT2_VOCAB_SIZE,
        hidden_size: int = 650,
        num_layers: int = 3,
        dropout: float = 0.4,
        tie_weights: bool = True,
    ) -> None:
        """Build the model; the embedding size equals ``hidden_size`` so weights can be tied.

        Args:
            ntoken: vocabulary size (also the number of output logits).
            hidden_size: embedding size and LSTM hidden size.
            num_layers: number of stacked LSTM layers.
            dropout: dropout on embeddings, between LSTM layers and on the LSTM output.
            tie_weights: share one ``[ntoken, hidden_size]`` matrix between the embedding
                and the decoder (Press & Wolf, 2017; Inan et al., 2017).
        """
        super().__init__()
        sizes = {"ntoken": ntoken, "hidden_size": hidden_size, "num_layers": num_layers}
        for arg, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{arg} must be a positive int, got {value!r}")
            if value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.ntoken = ntoken
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, hidden_size)
        # nn.LSTM only drops out between layers (and warns if asked to with one layer).
        inter_layer_dropout = dropout if num_layers > 1 else 0.0
        self.rnn = nn.LSTM(hidden_size, hidden_size, num_layers, dropout=inter_layer_dropout)
        self.decoder = nn.Linear(hidden_size, ntoken)
        self._init_weights()
        if tie_weights:
            # One Parameter object under two names; model.parameters() yields it once.
            self.decoder.weight = self.encoder.weight

    def _init_weights(self) -> None:
        """Draw embedding/decoder weights from U(-0.1, 0.1) and zero the decoder bias."""
        init_range = 0.1
        nn.init.uniform_(self.encoder.weight, -init_range, init_range)
        nn.init.uniform_(self.decoder.weight, -init_range, init_range)
        nn.init.zeros_(self.decoder.bias)

    def init_hidden(self, batch_size: int) -> Hidden:
        """Return zero ``(h, c)`` states of shape ``[num_layers, batch_size, hidden_size]``."""
        weight = self.encoder.weight
        shape = (self.num_layers, batch_size, self.hidden_size)
        return weight.new_zeros(shape), weight.new_zeros(shape)

    def forward(self, tokens: Tensor, hidden: Hidden | None = None) -> tuple[Tensor, Hidden]:
        """Map ``tokens[seq, batch]`` to ``(logits[seq, batch, ntoken], new_hidden)``.

        ``hidden`` defaults to zeros; pass the returned state (detached) to carry it across
        truncated-BPTT windows.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [seq, batch], got shape {tuple(tokens.shape)}")
        if hidden is None:
            hidden = self.init_hidden(tokens.size(1))
        emb = self.drop(self.encoder(tokens))
        output, hidden = self.rnn(emb, hidden)
        logits = self.decoder(self.drop(output))
        return logits, hidden
