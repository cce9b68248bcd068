"""The classical PCA monitor: Hotelling T^2 on the retained components and Q (SPE) on the residual,
each with a 99 % control limit fitted on normal operation (F-distribution limit for T^2, Jackson-
Mudholkar for Q). An alarm is T^2 > limit or Q > limit (reported separately and combined).

numpy + scipy only.
"""
from __future__ import annotations

import numpy as np


class PCAMonitor:
    def __init__(self, variance: float = 0.90, alpha: float = 0.99):
        self.variance, self.alpha = variance, alpha

    def fit(self, X: np.ndarray) -> "PCAMonitor":
        from scipy import stats

        X = np.asarray(X, np.float64)
        self.mean, self.std = X.mean(0), X.std(0) + 1e-8
        Z = (X - self.mean) / self.std
        n = len(Z)
        cov = Z.T @ Z / (n - 1)
        w, V = np.linalg.eigh(cov)
        order = np.argsort(w)[::-1]
        w, V = np.clip(w[order], 1e-12, None), V[:, order]
        k = int(np.searchsorted(np.cumsum(w) / w.sum(), self.variance) + 1)
        self.k, self.P, self.lam, self.resid_lam = k, V[:, :k], w[:k], w[k:]
        a = self.alpha
        self.t2_limit = k * (n - 1) * (n + 1) / (n * (n - k)) * stats.f.ppf(a, k, n - k)
        th1, th2, th3 = (np.sum(self.resid_lam ** i) for i in (1, 2, 3))
        h0 = 1 - 2 * th1 * th3 / (3 * th2 ** 2)
        ca = stats.norm.ppf(a)
        self.q_limit = th1 * (ca * np.sqrt(2 * th2 * h0 ** 2) / th1 + 1 + th2 * h0 * (h0 - 1) / th1 ** 2) ** (1 / h0)
        return self

    def scores(self, X: np.ndarray):
        Z = (np.asarray(X, np.float64) - self.mean) / self.std
        T = Z @ self.P
        t2 = np.sum(T ** 2 / self.lam, axis=1)
        R = Z - T @ self.P.T
        q = np.sum(R ** 2, axis=1)
        return t2, q

    def alarms(self, X: np.ndarray) -> dict:
        t2, q = self.scores(X)
        a_t2, a_q = t2 > self.t2_limit, q > self.q_limit
        return {"t2": a_t2, "q": a_q, "t2_or_q": a_t2 | a_q}
