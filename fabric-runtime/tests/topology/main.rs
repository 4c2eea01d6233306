//! Topology detection on sysfs trees shaped like real servers: a DGX H100 (8 GPUs, 8 CX-7),
//! a p5.48xlarge (8 GPUs, 32 EFA), a machine with no GPU or RDMA NIC (like the CI machine),
//! one with a GPU but no RDMA NIC, one with only Soft-RoCE, and a mixed one for the
//! assignment rules. The fixtures use real
//! symlinks laid out as the kernel lays them out, so detection follows them as it would on
//! `/sys`.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

use fabric_runtime::topology::{Affinity, NicKind, SwitchGroup, Topology, TopologyOverride};
use fabric_runtime::Error;

mod fixtures;
use fixtures::*;

#[test]
fn dgx_h100_pairs_each_gpu_with_its_cx7() {
    let f = dgx_h100();
    let t = f.topology();

    let gpus: Vec<&str> = t.gpus().iter().map(|g| g.pci.as_str()).collect();
    assert_eq!(
        gpus,
        [
            "0000:1b:00.0",
            "0000:43:00.0",
            "0000:52:00.0",
            "0000:61:00.0",
            "0000:9d:00.0",
            "0000:c3:00.0",
            "0000:d1:00.0",
            "0000:df:00.0"
        ],
        "the NVSwitch is not a GPU; GPUs in PCI order"
    );
    let g0 = &t.gpus()[0];
    assert_eq!((g0.index, g0.device_id, g0.numa_node), (0, Some(0x2330), Some(0)));
    assert_eq!(g0.host_bridge.as_deref(), Some("pci0000:15"));
    assert_eq!(g0.pci_path, ["0000:15:01.0", "0000:16:00.0", "0000:17:01.0"]);

    assert_eq!(t.nics().len(), 8);
    let n0 = t.nic("mlx5_0").unwrap();
    assert_eq!(n0.kind, NicKind::Verbs);
    assert_eq!(
        (n0.pci.as_deref(), n0.numa_node, n0.netdev.as_deref()),
        (Some("0000:18:00.0"), Some(0), Some("ibp24s0"))
    );
    assert_eq!(n0.ports.len(), 1);
    assert_eq!(n0.ports[0].state.as_deref(), Some("ACTIVE"));
    assert_eq!(n0.ports[0].link_layer.as_deref(), Some("InfiniBand"));
    assert_eq!(n0.ports[0].rate.as_deref(), Some("400 Gb/sec (4X NDR)"));

    // Eight switch groups; the NVSwitch's root port holds no GPU or NIC, so it is none.
    let want: Vec<SwitchGroup> = DGX_PAIRS
        .iter()
        .enumerate()
        .map(|(i, &(nic_bus, _, node))| SwitchGroup {
            root_port: format!("0000:{:02x}:01.0", nic_bus - 3),
            host_bridge: Some(format!("pci0000:{:02x}", nic_bus - 3)),
            numa_node: Some(node as u32),
            gpus: vec![i],
            nics: vec![format!("mlx5_{i}")],
        })
        .collect();
    assert_eq!(t.groups(), want);

    // NUMA nodes: 112 CPUs, 56 physical cores each.
    let nodes = t.numa_nodes();
    assert_eq!(nodes.len(), 2);
    assert_eq!((nodes[0].cpus.len(), nodes[0].cores.clone()), (112, range(0, 55)));
    assert_eq!((nodes[1].cpus.len(), nodes[1].cores.clone()), (112, range(56, 111)));
    assert_eq!(t.online_cpus().len(), 224);

    for (i, p) in t.plans().iter().enumerate() {
        assert_eq!(p.gpu, i);
        assert_eq!(p.nics, [format!("mlx5_{i}")], "GPU{i}");
        assert_eq!(p.affinity, Some(Affinity::Switch));
        let node = u32::from(i >= 4);
        assert_eq!(p.numa_node, Some(node));
        assert_eq!(p.cores.len(), 56);
        assert_eq!((p.cores[0], p.cores[55]), (56 * node, 56 * node + 55));
        assert_eq!(p.cpus.len(), 112);
        assert!(!p.overridden);
    }
    let reactors: Vec<Option<u32>> = t.plans().iter().map(|p| p.reactor_core).collect();
    assert_eq!(reactors, [55, 54, 53, 52, 111, 110, 109, 108].map(Some), "highest cores first, one per GPU");

    assert_eq!(t.affinity(0, "mlx5_0"), Some(Affinity::Switch));
    assert_eq!(t.affinity(0, "mlx5_1"), Some(Affinity::NumaNode));
    assert_eq!(t.affinity(0, "mlx5_7"), Some(Affinity::System));
    assert_eq!(t.affinity(8, "mlx5_0"), None);
    assert_eq!(t.gpu_by_pci("00000000:1B:00.0").map(|g| g.index), Some(0));
    assert_eq!(t.gpu_by_pci("df:00.0").map(|g| g.index), Some(7));
    assert!(t.gpu_by_pci("0000:18:00.0").is_none(), "a NIC is not a GPU");

    let shown = t.to_string();
    println!("{shown}");
    assert!(shown.contains("8 GPU(s), 8 RDMA NIC(s), 2 NUMA node(s), 224 online CPU(s)"), "{shown}");
    assert!(shown.contains("NUMA node 0: CPUs 0-55,112-167 (56 physical cores)"), "{shown}");
    assert!(
        shown.contains("GPU0  0000:1b:00.0 NUMA 0  NICs mlx5_0 (switch) cores 0-55 (56) reactor 55"),
        "{shown}"
    );
}

#[test]
fn p5_gives_each_gpu_its_four_efa() {
    let f = p5_48xlarge();
    let t = f.topology();
    assert_eq!(t.gpus().len(), 8);
    assert_eq!(t.nics().len(), 32);
    assert!(t.nics().iter().all(|n| n.kind == NicKind::Efa && n.netdev.is_none()));
    assert_eq!(t.nics()[0].name, "rdmap20s0");
    assert_eq!(t.nics()[0].ports[0].link_layer.as_deref(), Some("Unspecified"));
    assert_eq!(t.groups().len(), 8);
    for (k, g) in t.groups().iter().enumerate() {
        assert_eq!(g.gpus, [k]);
        assert_eq!(g.nics.len(), 4);
        assert_eq!(g.root_port, format!("0000:{:02x}:01.0", 0x10 + 0x10 * k));
    }
    for (k, p) in t.plans().iter().enumerate() {
        let b = 0x10 + 0x10 * k + 4;
        let want: Vec<String> = (b..b + 4).map(|bus| format!("rdmap{bus}s0")).collect();
        assert_eq!(p.nics, want, "GPU{k}");
        assert_eq!(p.affinity, Some(Affinity::Switch));
        let node = u32::from(k >= 4);
        assert_eq!(p.numa_node, Some(node));
        assert_eq!(p.cores.len(), 48);
        assert_eq!((p.cores[0], p.cores[47]), (48 * node, 48 * node + 47));
    }
    assert_eq!(t.plan(0).unwrap().nics, ["rdmap20s0", "rdmap21s0", "rdmap22s0", "rdmap23s0"]);
    assert_eq!(t.plan(7).unwrap().nics, ["rdmap132s0", "rdmap133s0", "rdmap134s0", "rdmap135s0"]);
    let reactors: Vec<Option<u32>> = t.plans().iter().map(|p| p.reactor_core).collect();
    assert_eq!(reactors, [47, 46, 45, 44, 95, 94, 93, 92].map(Some));
    assert!(t.plan(8).is_none());
}

#[test]
fn machine_without_gpu_or_rdma_nic_has_empty_plans() {
    let f = ci_vm();
    let t = f.topology();
    assert!(t.gpus().is_empty() && t.nics().is_empty() && t.groups().is_empty());
    assert!(t.plans().is_empty());
    assert!(t.plan(0).is_none());
    assert_eq!(t.numa_nodes().len(), 1);
    assert_eq!(t.numa_nodes()[0].cores, [0, 1]);
    assert_eq!(t.online_cpus(), [0, 1]);
    assert!(t.to_string().contains("No NVIDIA GPU: no plans."), "{t}");
}

#[test]
fn rxe_only_is_a_software_nic() {
    let f = rxe_only(false);
    let t = f.topology();
    assert!(t.plans().is_empty());
    let rxe = t.nic("rxe0").unwrap();
    assert_eq!(rxe.kind, NicKind::Software);
    assert_eq!((rxe.pci.as_deref(), rxe.numa_node, rxe.netdev.as_deref()), (None, None, Some("enp0s3")));
    assert!(rxe.pci_path.is_empty() && rxe.host_bridge.is_none());
    assert_eq!(rxe.ports[0].link_layer.as_deref(), Some("Ethernet"));
    assert!(t.groups().is_empty(), "a software NIC belongs to no switch");

    // With a GPU and nothing better, the GPU uses rxe0.
    let f = rxe_only(true);
    let t = f.topology();
    let p = t.plan(0).unwrap();
    assert_eq!((p.nics.clone(), p.affinity, p.numa_node), (names(&["rxe0"]), Some(Affinity::System), None));
    assert_eq!((p.cores.clone(), p.reactor_core), (vec![0, 1], Some(1)), "unknown node: all CPUs");
}

#[test]
fn mixed_machine_splits_and_falls_back() {
    let f = mixed();
    let t = f.topology();
    assert_eq!(t.gpus().len(), 5);
    let nic_names: Vec<&str> = t.nics().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(nic_names, ["mlx5_0", "mlx5_1", "mlx5_2", "rxe0"], "PCI order, software last");
    assert_eq!(t.nic("mlx5_2").unwrap().ports[0].state.as_deref(), Some("DOWN"));

    let groups: Vec<(&str, Vec<usize>, Vec<String>)> =
        t.groups().iter().map(|g| (g.root_port.as_str(), g.gpus.clone(), g.nics.clone())).collect();
    assert_eq!(
        groups,
        [
            ("0000:10:01.0", vec![0, 1], names(&["mlx5_0", "mlx5_1"])),
            ("0000:20:01.0", vec![2], vec![]),
            ("0000:30:01.0", vec![3], names(&["mlx5_2"])),
            ("0000:30:02.0", vec![4], vec![]),
        ]
    );

    let plans: Vec<(Vec<String>, Option<Affinity>, Option<u32>)> =
        t.plans().iter().map(|p| (p.nics.clone(), p.affinity, p.numa_node)).collect();
    assert_eq!(
        plans,
        [
            (names(&["mlx5_0"]), Some(Affinity::Switch), Some(0)), // 2 GPUs, 2 NICs: one each
            (names(&["mlx5_1"]), Some(Affinity::Switch), Some(0)),
            (names(&["mlx5_0", "mlx5_1"]), Some(Affinity::NumaNode), Some(0)), // no NIC on its switch
            (names(&["mlx5_2"]), Some(Affinity::Switch), Some(1)),
            (names(&["mlx5_2"]), Some(Affinity::HostBridge), Some(1)),
        ]
    );
    // Cores from core_id/physical_package_id: CPU c and c+8 are one core.
    assert_eq!(t.numa_nodes()[0].cores, [0, 1, 2, 3]);
    assert_eq!(t.numa_nodes()[1].cores, [4, 5, 6, 7]);
    assert_eq!(t.plan(2).unwrap().cpus, [0, 1, 2, 3, 8, 9, 10, 11]);
    let reactors: Vec<Option<u32>> = t.plans().iter().map(|p| p.reactor_core).collect();
    assert_eq!(reactors, [3, 2, 1, 7, 6].map(Some));
    println!("{t}");
}

#[test]
fn two_gpus_one_nic_share_it() {
    let f = Fixture::new("shared");
    let bridges =
        |d: u8| ["0000:10:01.0".to_string(), "0000:11:00.0".to_string(), format!("0000:12:{d:02x}.0")];
    for (d, bdf, ids) in [(0, "0000:13:00.0", &H100), (1, "0000:14:00.0", &H100)] {
        let b = bridges(d);
        f.pci(&Pci { host: "pci0000:10", bridges: &[&b[0], &b[1], &b[2]], bdf }, ids, 0);
    }
    let b = bridges(2);
    let nic = Pci { host: "pci0000:10", bridges: &[&b[0], &b[1], &b[2]], bdf: "0000:15:00.0" };
    f.pci(&nic, &CX7, 0);
    f.ib("mlx5_0", &nic, None, &[NDR]);
    f.node(0, "0-3");
    f.cpus(4, |_| None);
    let t = f.topology();
    assert_eq!(t.plan(0).unwrap().nics, ["mlx5_0"]);
    assert_eq!(t.plan(1).unwrap().nics, ["mlx5_0"]);
    assert_eq!((t.plan(0).unwrap().reactor_core, t.plan(1).unwrap().reactor_core), (Some(3), Some(2)));
}

#[test]
fn restricting_cpus_keeps_plans_inside_the_cpuset() {
    let f = dgx_h100();
    let mut t = f.topology();
    let allowed: Vec<u32> = (0..8).chain(112..120).collect();
    t.restrict_cpus(&allowed);
    assert_eq!(t.allowed_cpus(), Some(allowed.as_slice()));
    for p in &t.plans()[..4] {
        assert_eq!((p.cpus.clone(), p.cores.clone()), (allowed.clone(), range(0, 7)));
    }
    for p in &t.plans()[4..] {
        assert_eq!(p.cores, range(0, 7), "node 1 has no allowed CPU: any allowed core");
    }
    let reactors: Vec<Option<u32>> = t.plans().iter().map(|p| p.reactor_core).collect();
    assert_eq!(reactors, [7, 6, 5, 4, 3, 2, 1, 0].map(Some), "distinct while there are cores");
    assert!(t.to_string().contains("this process may run on CPUs 0-7,112-119"));

    t.restrict_cpus(&[5000]); // no online CPU in it: ignored
    assert_eq!(t.allowed_cpus(), None);
    assert_eq!(t.plan(0).unwrap().cores.len(), 56);
}

#[test]
fn override_grammar_parses_and_round_trips() {
    let ov: TopologyOverride = "0=mlx5_0,mlx5_1;1=mlx5_2@cores:8-15".parse().unwrap();
    assert_eq!(ov.entries.len(), 2);
    assert_eq!(ov.entries[0].nics, Some(names(&["mlx5_0", "mlx5_1"])));
    assert_eq!((ov.entries[0].cores.clone(), ov.entries[0].numa_node), (None, None));
    assert_eq!(ov.entries[1].gpu, 1);
    assert_eq!(ov.entries[1].cores, Some(range(8, 15)));

    let ov: TopologyOverride =
        " 3 = @ numa:1 @reactor: 9 ; ; 4=rdmap20s0@cores:0-3,8,10-11 ;".parse().unwrap();
    assert_eq!(ov.entries[0].nics, None);
    assert_eq!((ov.entries[0].numa_node, ov.entries[0].reactor_core), (Some(1), Some(9)));
    assert_eq!(ov.entries[1].cores, Some(vec![0, 1, 2, 3, 8, 10, 11]));
    let text = ov.to_string();
    assert_eq!(text, "3=@numa:1@reactor:9;4=rdmap20s0@cores:0-3,8,10-11");
    assert_eq!(text.parse::<TopologyOverride>().unwrap(), ov);

    assert!("".parse::<TopologyOverride>().unwrap().entries.is_empty());
}

#[test]
fn override_grammar_names_the_bad_token() {
    let cases = [
        ("x=mlx5_0", "x"),
        ("0mlx5_0", "0mlx5_0"),
        ("0=mlx5_0;-1=mlx5_1", "-1"),
        ("0=mlx5_0@core:1", "core:1"),
        ("0=mlx5_0@cores:8-x", "cores:8-x"),
        ("0=mlx5_0@cores:15-8", "cores:15-8"),
        ("0=mlx5_0@cores:", "cores:"),
        ("0=mlx5_0@numa", "numa"),
        ("0=mlx5_0@numa:one", "numa:one"),
        ("0=mlx5_0@numa:1@numa:0", "numa:0"),
        ("0=mlx5 0", "mlx5 0"),
        ("0=mlx5_0,,mlx5_1", ""),
        ("0=mlx5_0,mlx5_0", "mlx5_0"),
        ("0=a;0=b", "0"),
        ("0=", "0="),
        ("1=@", ""),
    ];
    for (spec, token) in cases {
        match spec.parse::<TopologyOverride>() {
            Err(Error::TopologyOverride { token: t, reason }) => {
                assert_eq!(t, token, "{spec:?}: {reason}");
                assert!(!reason.is_empty());
            }
            other => panic!("{spec:?} should fail naming {token:?}, got {other:?}"),
        }
    }
    let e = "0=mlx5_0@cores:8-x".parse::<TopologyOverride>().unwrap_err().to_string();
    assert!(e.contains("\"cores:8-x\""), "{e}");
}

#[test]
fn override_applies_on_top_of_detection() {
    let f = dgx_h100();
    let mut t = f.topology();
    let ov = "0=mlx5_1,mlx5_0;1=mlx5_2@cores:8-15;2=@numa:1;3=@reactor:0".parse().unwrap();
    t.apply_override(&ov).unwrap();
    let p = |t: &Topology, i: usize| t.plan(i).unwrap().clone();
    assert_eq!(p(&t, 0).nics, ["mlx5_1", "mlx5_0"], "as listed");
    assert_eq!(p(&t, 0).affinity, Some(Affinity::NumaNode), "the farthest of its NICs");
    assert!(p(&t, 0).overridden && !p(&t, 4).overridden);
    assert_eq!(
        (p(&t, 1).nics, p(&t, 1).cores.clone(), p(&t, 1).cpus),
        (names(&["mlx5_2"]), range(8, 15), range(8, 15))
    );
    assert_eq!(
        (p(&t, 2).nics, p(&t, 2).numa_node, p(&t, 2).cores),
        (names(&["mlx5_2"]), Some(1), range(56, 111))
    );
    let reactors: Vec<Option<u32>> = t.plans().iter().map(|p| p.reactor_core).collect();
    assert_eq!(reactors, [55, 15, 111, 0, 110, 109, 108, 107].map(Some));
    assert!(t.to_string().contains("[override]"));

    // A later override merges with the earlier one.
    t.apply_override(&"1=@reactor:9".parse().unwrap()).unwrap();
    assert_eq!((p(&t, 1).reactor_core, p(&t, 1).nics), (Some(9), names(&["mlx5_2"])));
    assert_eq!(
        t.overrides().to_string(),
        "0=mlx5_1,mlx5_0;1=mlx5_2@cores:8-15@reactor:9;2=@numa:1;3=@reactor:0"
    );

    // What does not exist here is refused, naming it, and changes nothing.
    let before = t.clone();
    for (spec, token) in [
        ("9=mlx5_0", "9"),
        ("0=mlx5_9", "mlx5_9"),
        ("0=@numa:5", "numa:5"),
        ("0=@cores:8,300", "cores:8,300"),
        ("0=@reactor:999", "reactor:999"),
        ("1=mlx5_0;0=mlx5_9", "mlx5_9"),
    ] {
        match t.apply_override(&spec.parse().unwrap()) {
            Err(Error::TopologyOverride { token: t, reason }) => assert_eq!(t, token, "{spec}: {reason}"),
            other => panic!("{spec:?}: {other:?}"),
        }
    }
    assert_eq!(t, before);
}

#[test]
fn malformed_sysfs_files_are_errors_naming_the_file() {
    fn expect_err(f: &Fixture, file: &str) {
        match Topology::from_sysfs(&f.root) {
            Err(Error::Sysfs { path, message }) => {
                assert!(path.ends_with(file), "{} should end with {file}: {message}", path.display())
            }
            other => panic!("expected an error about {file}, got {other:?}"),
        }
    }
    let f = dgx_h100();
    f.write("sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:1b:00.0/numa_node", "zero");
    expect_err(&f, "0000:1b:00.0/numa_node");

    let f = ci_vm();
    f.write("sys/devices/system/node/node0/cpulist", "0-1,x");
    expect_err(&f, "node0/cpulist");

    let f = ci_vm();
    f.write("sys/devices/pci0000:00/0000:00:03.0/vendor", "");
    expect_err(&f, "0000:00:03.0/vendor");

    let f = ci_vm();
    f.write("sys/devices/system/cpu/cpu1/topology/thread_siblings_list", "1-0");
    expect_err(&f, "cpu1/topology/thread_siblings_list");

    // A directory where a file should be: unreadable.
    let f = ci_vm();
    let class = f.root.join("sys/devices/pci0000:00/0000:00:03.0/vendor");
    fs::remove_file(&class).unwrap();
    fs::create_dir(&class).unwrap();
    expect_err(&f, "0000:00:03.0/vendor");

    // Odd but harmless content: not a GPU, no panic.
    let f = ci_vm();
    f.write("sys/devices/pci0000:00/0000:00:03.0/class", "0x");
    f.write("sys/bus/pci/devices/not-a-device/vendor", "0x10de");
    assert!(Topology::from_sysfs(&f.root).unwrap().gpus().is_empty());
}

#[test]
fn missing_optional_files_are_fine() {
    // An empty tree: no devices, no CPUs, no error.
    let f = Fixture::new("empty");
    let t = f.topology();
    assert!(
        t.gpus().is_empty() && t.nics().is_empty() && t.numa_nodes().is_empty() && t.online_cpus().is_empty()
    );

    // But the root itself must exist.
    let gone = f.root.join("nope");
    assert!(matches!(Topology::from_sysfs(&gone), Err(Error::Sysfs { ref path, .. }) if *path == gone));

    // A GPU without numa_node, ports without rate, a NIC whose PCI device lost its files.
    let f = dgx_h100();
    fs::remove_file(
        f.root.join("sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:1b:00.0/numa_node"),
    )
    .unwrap();
    fs::remove_file(f.root.join("sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0/infiniband/mlx5_0/ports/1/rate")).unwrap();
    let t = f.topology();
    assert_eq!(t.gpus()[0].numa_node, None);
    assert_eq!(t.nic("mlx5_0").unwrap().ports[0].rate, None);
    let p = t.plan(0).unwrap();
    assert_eq!(
        (p.nics.clone(), p.numa_node, p.cores.len()),
        (names(&["mlx5_0"]), None, 112),
        "all CPUs' cores"
    );
}

#[test]
fn detect_on_this_machine() {
    let t = Topology::detect().unwrap_or_else(|e| panic!("detecting this machine: {e}"));
    assert!(!t.online_cpus().is_empty());
    assert_eq!(t.plans().len(), t.gpus().len());
    for p in t.plans() {
        if let Some(r) = p.reactor_core {
            assert!(p.cores.contains(&r));
        }
    }
    println!("{t}");

    // FABRIC_TOPOLOGY is read and checked (this is the only test that sets it).
    std::env::set_var("FABRIC_TOPOLOGY", "nonsense");
    let r = Topology::detect_with_env();
    std::env::set_var("FABRIC_TOPOLOGY", "  ");
    let blank = Topology::detect_with_env();
    std::env::remove_var("FABRIC_TOPOLOGY");
    assert!(matches!(r, Err(Error::TopologyOverride { ref token, .. }) if token == "nonsense"), "{r:?}");
    assert!(blank.is_ok());
}

#[test]
fn detect_follows_a_symlinked_root() {
    let f = dgx_h100();
    let link = Fixture::new("link");
    let root = link.root.join("root");
    symlink(&f.root, &root).unwrap();
    let t = Topology::from_sysfs(Path::new(&root)).unwrap();
    assert_eq!(t.plan(3).unwrap().nics, ["mlx5_3"]);
    assert_eq!(t.gpus()[3].pci_path, ["0000:5b:01.0", "0000:5c:00.0", "0000:5d:01.0"]);
}

#[test]
fn engine_builder_takes_nics_and_reactor_core_from_the_plan() {
    use fabric_runtime::Engine;
    let dgx = dgx_h100().topology();
    for gpu in 0..8 {
        let plan = dgx.plan(gpu).unwrap();
        let b = Engine::builder().for_gpu(&dgx, gpu).unwrap();
        assert_eq!(b.provider_name(), "verbs");
        assert_eq!(b.nic_names(), [format!("mlx5_{gpu}")], "GPU {gpu} gets the CX-7 on its switch");
        assert_eq!(b.reactor_core(), plan.reactor_core.map(|c| c as usize));
        assert!(b.reactor_core().is_some());
    }
    let p5 = p5_48xlarge().topology();
    let b = Engine::builder().for_gpu(&p5, 0).unwrap();
    assert_eq!(b.provider_name(), "efa");
    assert_eq!(b.nic_names().len(), 4, "four EFA devices per GPU");
    assert!(b.nic_names().iter().all(|n| n.ends_with("-rdm")), "libfabric domain names: {:?}", b.nic_names());
    // No GPU at all (this machine): GPU 0 is not in the topology. (A GPU without an RDMA NIC:
    // see gpu_without_rdma_nic_is_a_config_error_for_the_builder.)
    let e = Engine::builder().for_gpu(&ci_vm().topology(), 0).unwrap_err();
    assert!(matches!(e, Error::Config(ref m) if m.contains("GPU 0 is not in the topology")), "{e}");
    let e = Engine::builder().for_gpu(&dgx, 8).unwrap_err();
    assert!(e.to_string().contains("GPU 8"), "{e}");
}

/// A GPU but no RDMA NIC: the GPU gets a plan with no NICs (and still its cores), and
/// `for_gpu` refuses it with `Error::Config` naming the GPU, as documented in
/// `docs/topology.md`, rather than choosing a provider on its own.
#[test]
fn gpu_without_rdma_nic_is_a_config_error_for_the_builder() {
    use fabric_runtime::Engine;
    let f = gpu_without_rdma_nic();
    assert!(!f.root.join("sys/class/infiniband").exists());
    let t = f.topology();
    assert_eq!(t.gpus().len(), 1);
    assert!(t.nics().is_empty() && t.groups().is_empty());
    let p = t.plan(0).expect("the GPU has a plan");
    assert_eq!((p.pci.as_str(), p.nics.is_empty(), p.affinity), ("0000:00:06.0", true, None));
    assert_eq!((p.cores.clone(), p.reactor_core), (vec![0, 1], Some(1)), "cores are planned anyway");
    match Engine::builder().for_gpu(&t, 0) {
        Err(Error::Config(m)) => {
            assert_eq!(m, "the topology has no RDMA NIC for GPU 0 (0000:00:06.0)");
        }
        other => panic!("expected Error::Config, got {other:?}"),
    }
}
