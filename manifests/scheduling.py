"""Where the agent pods run: node affinity and tolerations for cloud and KubeEdge edge nodes."""

from __future__ import annotations

from typing import Any

EDGE_ROLE = "node-role.kubernetes.io/edge"


def edge_scheduling() -> dict[str, Any]:
    """Only KubeEdge edge nodes; stay through cloud disconnections (edge autonomy)."""
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": EDGE_ROLE, "operator": "Exists"}]}
                    ]
                }
            }
        },
        "tolerations": [
            {"key": EDGE_ROLE, "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
    }


def cloud_scheduling(*absent_labels: str) -> dict[str, Any]:
    """Every selected node except KubeEdge edge nodes (kubeedge/ covers those) and those with
    absent_labels."""
    expressions = [
        {"key": label, "operator": "DoesNotExist"} for label in (EDGE_ROLE, *absent_labels)
    ]
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": expressions}]
                }
            }
        },
        "tolerations": [{"operator": "Exists"}],
    }
