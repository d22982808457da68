"""The training harness: data, training, comparison and plots. The library never imports it."""
