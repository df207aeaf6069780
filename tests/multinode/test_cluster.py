"""The multinode cluster behaves like separate machines: private /tmp and /dev/shm, objects still travel."""

import pytest

pytestmark = pytest.mark.integration

CUSTOM = ("head", "rollout", "trainer")


def test_nodes_and_resources(multinode_cluster):
    nodes = multinode_cluster.run_driver("""
        import ray

        ray.init()
        emit([n["Resources"] for n in ray.nodes() if n["Alive"]])
    """)
    assert len(nodes) == 3, nodes
    declared = sorted((name, res[name], res["CPU"]) for res in nodes for name in CUSTOM if name in res)
    assert declared == [("head", 1, 2), ("rollout", 2, 4), ("trainer", 2, 4)], nodes


def test_files_do_not_cross_nodes(multinode_cluster):
    seen = multinode_cluster.run_driver("""
        import os
        import uuid

        import ray

        ray.init()
        PATHS = [f"/tmp/mn-{uuid.uuid4().hex}", f"/dev/shm/mn-{uuid.uuid4().hex}"]


        def node_and_files():
            return ray.get_runtime_context().get_node_id(), [os.path.exists(p) for p in PATHS]


        @ray.remote(num_cpus=0)
        def write():
            for p in PATHS:
                with open(p, "w") as f:
                    f.write("written on the rollout node")
            return node_and_files()


        @ray.remote(num_cpus=0)
        def look():
            return node_and_files()


        rollout = ray.get(write.options(resources={"rollout": 0.01}).remote())
        trainer = ray.get(look.options(resources={"trainer": 0.01}).remote())
        head = ray.get(look.options(resources={"head": 0.01}).remote())
        emit({"rollout": rollout, "trainer": trainer, "head": head})
    """)
    node_ids = {name: node_id for name, (node_id, _) in seen.items()}
    assert len(set(node_ids.values())) == 3, node_ids
    assert seen["rollout"][1] == [True, True]
    assert seen["trainer"][1] == [False, False], "the trainer node sees the rollout node's /tmp or /dev/shm"
    assert seen["head"][1] == [False, False], "the head node sees the rollout node's /tmp or /dev/shm"


def test_objects_cross_nodes(multinode_cluster):
    out = multinode_cluster.run_driver("""
        import hashlib

        import numpy as np
        import ray

        ray.init()


        def node_id():
            return ray.get_runtime_context().get_node_id()


        @ray.remote(num_cpus=0, resources={"trainer": 0.01})
        class Producer:
            def put(self):
                array = np.random.default_rng(0).integers(0, 255, size=50 * 2**20, dtype=np.uint8)
                self.ref = ray.put(array)  # this actor owns the object and outlives the transfer
                return [self.ref], node_id(), hashlib.sha256(array).hexdigest()  # nested: stays a ref


        @ray.remote(num_cpus=0, resources={"rollout": 0.01})
        def fetch(refs):
            array = ray.get(refs[0])
            return node_id(), hashlib.sha256(array).hexdigest(), array.nbytes


        producer = Producer.remote()
        refs, made_on, made = ray.get(producer.put.remote())
        got_on, got, nbytes = ray.get(fetch.remote(refs))
        emit({"made_on": made_on, "got_on": got_on, "made": made, "got": got, "nbytes": nbytes})
    """)
    assert out["made_on"] != out["got_on"]
    assert out["got"] == out["made"]
    assert out["nbytes"] == 50 * 2**20


def test_add_and_remove_node(multinode_cluster):
    node = multinode_cluster.add_node({"rollout": 1}, num_cpus=2, name="rollout-2")
    try:
        rollout = multinode_cluster.run_driver("""
            import ray

            ray.init()
            emit(sorted(n["Resources"].get("rollout", 0) for n in ray.nodes() if n["Alive"]))
        """)
        assert rollout == [0, 0, 1, 2]
    finally:
        multinode_cluster.remove_node(node)  # raises if any of the node's processes survive
