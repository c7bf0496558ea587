"""Experiment trackers: every trained step's metrics, evaluations, managed jobs' train configs, alias moves and
exports, written to TensorBoard, Weights & Biases or MLflow beside the history lines.

One observer interface (`Tracker`, in `base`) for all three; a tracker's library is imported only when its
option is set, and none of them imports torch (the server process never does).
"""
