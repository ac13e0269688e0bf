"""Per-token modality codes of a batch's `modality` array: what kind of input each token is."""

TEXT, IMAGE, VIDEO = 0, 1, 2
MODALITIES = ("text", "image", "video")  # indexed by the codes
