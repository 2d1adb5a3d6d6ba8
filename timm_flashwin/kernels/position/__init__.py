"""The position-bias kernels: ``bias`` (a table gathered through an index, and the table's
gradient), ``mlp`` (SwinV2's cpb_mlp and SwinV2-CR's meta_mlp fused), ``launch``."""
