"""dres.eval: what the papers measure.

* :mod:`dres.eval.probe` — linear probe (cached features, AdamW lr 1e-2 cosine; several feature slots'
  probes trained together), the decayed-shortcut authors' probe as their code runs it, kNN (k=20, cosine,
  optionally on standardised features), effective rank of the class-token covariance (eq. 6: the entropy H,
  and exp(H)).
* :mod:`dres.eval.viz` — sample / MAE reconstruction grids (PNG) and t-SNE plots.
* :mod:`dres.eval.diffusion` — VP-SDE, noise-prediction loss, Euler-Maruyama and DPM-Solver samplers.
* :mod:`dres.eval.fid` — FID with the standard Inception weights when a path is given; the Frechet
  distance in a dres-trained classifier's feature space (not comparable to FID).
* :mod:`dres.eval.curves` — metrics over training (``curves.jsonl`` / ``curves.png``).
* :mod:`dres.eval.tblog` — evaluation results, their images and the hyper-parameters in TensorBoard.
"""

from dres.eval.diffusion import VPSDE, dpm_solver, euler_maruyama, noise_prediction_loss
from dres.eval.curves import (final_epoch_means, plot_curves, read_points, record_point, representation_metrics,
                              representation_metrics_per_head)
from dres.eval.fid import (ClassifierFeatures, FIDUnavailable, classifier_frechet_distance, fid, frechet_distance,
                           load_inception)
from dres.eval.probe import (AUTHORS_PROBE, authors_linear_probe, effective_rank, extract_features, knn_accuracy,
                             linear_probe, linear_probes)
from dres.eval.tblog import log_hparams, log_results
from dres.eval.viz import mae_reconstruction_grid, make_grid, save_grid, to_uint8, tsne_plot

__all__ = ["VPSDE", "dpm_solver", "euler_maruyama", "noise_prediction_loss", "FIDUnavailable", "fid", "final_epoch_means",
           "frechet_distance", "load_inception", "ClassifierFeatures", "classifier_frechet_distance", "plot_curves",
           "read_points", "record_point", "representation_metrics", "representation_metrics_per_head", "AUTHORS_PROBE", "authors_linear_probe", "effective_rank", "extract_features", "knn_accuracy",
           "linear_probe", "linear_probes", "log_hparams", "log_results", "mae_reconstruction_grid", "make_grid", "save_grid", "to_uint8", "tsne_plot"]
