//! The fixture builder: sysfs-shaped trees (PCI functions, bridges, InfiniBand and Soft-RoCE
//! devices, NUMA nodes, CPUs) in a temporary directory, and the machines the tests detect.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use fabric_runtime::topology::Topology;
/// A sysfs-shaped tree in a fresh temporary directory, removed on drop.
pub struct Fixture {
    pub root: PathBuf,
}

/// A PCI function: its host bridge, the bridges above it (root port first) and itself.
pub struct Pci<'a> {
    pub host: &'a str,
    pub bridges: &'a [&'a str],
    pub bdf: &'a str,
}

impl Pci<'_> {
    /// `sys/devices/pci0000:15/0000:15:01.0/.../0000:18:00.0`
    pub fn dir(&self) -> String {
        let mut p = format!("sys/devices/{}", self.host);
        for b in self.bridges {
            p = format!("{p}/{b}");
        }
        format!("{p}/{}", self.bdf)
    }
}

/// A PCI function's identity files.
pub struct Ids<'a> {
    pub vendor: &'a str,
    pub device: &'a str,
    pub class: &'a str,
    pub driver: &'a str,
}

pub const H100: Ids = Ids { vendor: "0x10de", device: "0x2330", class: "0x030200", driver: "nvidia" };
pub const CX7: Ids = Ids { vendor: "0x15b3", device: "0x1021", class: "0x020700", driver: "mlx5_core" };
pub const EFA: Ids = Ids { vendor: "0x1d0f", device: "0xefa1", class: "0x020000", driver: "efa" };
pub const NVSWITCH: Ids = Ids { vendor: "0x10de", device: "0x22a3", class: "0x068000", driver: "nvidia" };
pub const VIRTIO: Ids = Ids { vendor: "0x1af4", device: "0x1000", class: "0x020000", driver: "virtio-pci" };
pub const BRIDGE: Ids = Ids { vendor: "0x1000", device: "0xc030", class: "0x060400", driver: "pcieport" };

/// One port's `state`, `link_layer` and `rate`.
pub type Port<'a> = (&'a str, &'a str, &'a str);
pub const NDR: Port = ("4: ACTIVE", "InfiniBand", "400 Gb/sec (4X NDR)");
pub const EFA_PORT: Port = ("4: ACTIVE", "Unspecified", "100 Gb/sec");

impl Fixture {
    pub fn new(name: &str) -> Fixture {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "fabric-topology-{name}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        Fixture { root }
    }

    pub fn write(&self, rel: &str, contents: &str) {
        let path = self.root.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, format!("{contents}\n")).unwrap();
    }

    pub fn mkdir(&self, rel: &str) {
        fs::create_dir_all(self.root.join(rel)).unwrap();
    }

    /// A symlink at `rel` whose (relative) target is `target`, as sysfs makes them.
    pub fn link(&self, rel: &str, target: &str) {
        let path = self.root.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        symlink(target, path).unwrap();
    }

    /// A PCI function with its bridges; `/sys/bus/pci/devices/BDF` links to it.
    pub fn pci(&self, pci: &Pci, ids: &Ids, numa: i32) {
        let mut dir = format!("sys/devices/{}", pci.host);
        let chain = pci.bridges.iter().map(|b| (*b, &BRIDGE)).chain([(pci.bdf, ids)]);
        for (bdf, ids) in chain {
            dir = format!("{dir}/{bdf}");
            if self.root.join(&dir).join("vendor").exists() {
                continue; // a bridge shared with an earlier device
            }
            self.write(&format!("{dir}/vendor"), ids.vendor);
            self.write(&format!("{dir}/device"), ids.device);
            self.write(&format!("{dir}/class"), ids.class);
            self.write(&format!("{dir}/numa_node"), &numa.to_string());
            self.mkdir(&format!("sys/bus/pci/drivers/{}", ids.driver));
            // DIR/driver -> ../../../bus/pci/drivers/NAME (up from DIR to sys/)
            let up = "../".repeat(dir.split('/').count() - 1);
            self.link(&format!("{dir}/driver"), &format!("{up}bus/pci/drivers/{}", ids.driver));
            // /sys/bus/pci/devices/X -> ../../../devices/pci0000:15/.../X
            self.link(&format!("sys/bus/pci/devices/{bdf}"), &format!("../../../{}", &dir["sys/".len()..]));
        }
    }

    /// An RDMA device on PCI function `pci`, as the kernel registers it: under the PCI
    /// device, with `class/infiniband/NAME` and `NAME/device` links.
    pub fn ib(&self, name: &str, pci: &Pci, netdev: Option<&str>, ports: &[Port]) {
        let dev = pci.dir();
        let ibdir = format!("{dev}/infiniband/{name}");
        self.mkdir(&ibdir);
        self.link(&format!("sys/class/infiniband/{name}"), &format!("../../{}", &ibdir["sys/".len()..]));
        self.link(&format!("{ibdir}/device"), &format!("../../../{}", pci.bdf));
        if let Some(n) = netdev {
            self.mkdir(&format!("{dev}/net/{n}"));
        }
        self.ports(&ibdir, ports);
    }

    /// A software RDMA device (rxe) over netdev `parent`: no PCI device of its own.
    pub fn rxe(&self, name: &str, parent: &str) {
        let ibdir = format!("sys/devices/virtual/infiniband/{name}");
        self.mkdir(&ibdir);
        self.link(
            &format!("sys/class/infiniband/{name}"),
            &format!("../../devices/virtual/infiniband/{name}"),
        );
        self.write(&format!("{ibdir}/parent"), parent);
        self.ports(&ibdir, &[("4: ACTIVE", "Ethernet", "10 Gb/sec (1X QDR)")]);
        self.write(&format!("{ibdir}/ports/1/gid_attrs/ndevs/0"), parent);
    }

    pub fn ports(&self, ibdir: &str, ports: &[Port]) {
        for (i, (state, link_layer, rate)) in ports.iter().enumerate() {
            let p = format!("{ibdir}/ports/{}", i + 1);
            self.write(&format!("{p}/state"), state);
            self.write(&format!("{p}/link_layer"), link_layer);
            self.write(&format!("{p}/rate"), rate);
        }
    }

    /// NUMA node `id` with `cpulist`.
    pub fn node(&self, id: u32, cpulist: &str) {
        self.write(&format!("sys/devices/system/node/node{id}/cpulist"), cpulist);
    }

    /// `ncpus` online CPUs; `sibling(c)` is the SMT sibling of CPU `c`, if any.
    pub fn cpus(&self, ncpus: u32, sibling: impl Fn(u32) -> Option<u32>) {
        self.write("sys/devices/system/cpu/online", &format!("0-{}", ncpus - 1));
        for c in 0..ncpus {
            let list = match sibling(c) {
                Some(s) => format!("{},{}", c.min(s), c.max(s)),
                None => c.to_string(),
            };
            self.write(&format!("sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"), &list);
        }
    }

    pub fn topology(&self) -> Topology {
        Topology::from_sysfs(&self.root).unwrap_or_else(|e| panic!("detection failed: {e}"))
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

pub fn range(a: u32, b: u32) -> Vec<u32> {
    (a..=b).collect()
}

pub fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

// ---------------------------------------------------------------------------------------
// Machines
// ---------------------------------------------------------------------------------------

/// The (CX-7 bus, GPU bus, NUMA node) of a DGX H100's eight GPU/NIC pairs.
pub const DGX_PAIRS: [(u8, u8, i32); 8] = [
    (0x18, 0x1b, 0),
    (0x40, 0x43, 0),
    (0x4f, 0x52, 0),
    (0x5e, 0x61, 0),
    (0x9a, 0x9d, 1),
    (0xc0, 0xc3, 1),
    (0xce, 0xd1, 1),
    (0xdc, 0xdf, 1),
];

/// DGX H100: 2 sockets of 56 cores with SMT (CPUs c and c+112 are siblings); each GPU
/// shares a PCIe switch with one ConnectX-7, four switches per socket, each on its own host
/// bridge. Plus an NVSwitch (an NVIDIA bridge, not a GPU) and the BMC's NIC.
pub fn dgx_h100() -> Fixture {
    let f = Fixture::new("dgx");
    for (i, &(nic_bus, gpu_bus, node)) in DGX_PAIRS.iter().enumerate() {
        let hb = nic_bus - 3;
        let host = format!("pci0000:{hb:02x}");
        let (root_port, upstream) = (format!("0000:{hb:02x}:01.0"), format!("0000:{:02x}:00.0", hb + 1));
        let (down_nic, down_gpu) = (format!("0000:{:02x}:00.0", hb + 2), format!("0000:{:02x}:01.0", hb + 2));
        let (nic, gpu) = (format!("0000:{nic_bus:02x}:00.0"), format!("0000:{gpu_bus:02x}:00.0"));
        let gpu_pci = Pci { host: &host, bridges: &[&root_port, &upstream, &down_gpu], bdf: &gpu };
        f.pci(&gpu_pci, &H100, node);
        let nic_pci = Pci { host: &host, bridges: &[&root_port, &upstream, &down_nic], bdf: &nic };
        f.pci(&nic_pci, &CX7, node);
        f.ib(&format!("mlx5_{i}"), &nic_pci, Some(&format!("ibp{nic_bus}s0")), &[NDR]);
    }
    f.pci(&Pci { host: "pci0000:00", bridges: &["0000:00:01.0"], bdf: "0000:05:00.0" }, &NVSWITCH, 0);
    f.pci(&Pci { host: "pci0000:00", bridges: &["0000:00:1c.0"], bdf: "0000:02:00.0" }, &VIRTIO, 0);
    f.node(0, "0-55,112-167");
    f.node(1, "56-111,168-223");
    f.cpus(224, |c| Some((c + 112) % 224));
    f
}

/// p5.48xlarge: 8 H100, each behind a PCIe switch with 4 EFA devices (`rdmapNNs0`);
/// 2 sockets of 48 cores with SMT (CPUs c and c+96 are siblings).
pub fn p5_48xlarge() -> Fixture {
    let f = Fixture::new("p5");
    for k in 0..8u8 {
        let b = 0x10 + 0x10 * k;
        let node = i32::from(k >= 4);
        let host = format!("pci0000:{b:02x}");
        let root_port = format!("0000:{b:02x}:01.0");
        let upstream = format!("0000:{:02x}:00.0", b + 1);
        let down = |dev: u8| format!("0000:{:02x}:{dev:02x}.0", b + 2);
        let gpu = format!("0000:{:02x}:00.0", b + 3);
        f.pci(&Pci { host: &host, bridges: &[&root_port, &upstream, &down(0)], bdf: &gpu }, &H100, node);
        for j in 0..4u8 {
            let bus = b + 4 + j;
            let nic_pci = Pci {
                host: &host,
                bridges: &[&root_port, &upstream, &down(j + 1)],
                bdf: &format!("0000:{bus:02x}:00.0"),
            };
            f.pci(&nic_pci, &EFA, node);
            f.ib(&format!("rdmap{bus}s0"), &nic_pci, None, &[EFA_PORT]);
        }
    }
    f.node(0, "0-47,96-143");
    f.node(1, "48-95,144-191");
    f.cpus(192, |c| Some((c + 96) % 192));
    f
}

/// The CI machine: a 2-CPU VM, virtio devices straight on the host bridge with a
/// `numa_node` of -1, no GPU, no `/sys/class/infiniband`.
pub fn ci_vm() -> Fixture {
    let f = Fixture::new("vm");
    f.pci(&Pci { host: "pci0000:00", bridges: &[], bdf: "0000:00:00.0" }, &BRIDGE, -1);
    for d in 1..=5 {
        f.pci(&Pci { host: "pci0000:00", bridges: &[], bdf: &format!("0000:00:{d:02x}.0") }, &VIRTIO, -1);
    }
    f.node(0, "0-1");
    f.cpus(2, |_| None);
    f
}

/// Node 0 (CPUs 0-3 and their siblings 8-11):
///   switch A (pci0000:10): GPU0, GPU1, mlx5_0, mlx5_1     → split one each
///   switch B (pci0000:20): GPU2 alone                      → falls back to node 0's NICs
/// Node 1 (CPUs 4-7, 12-15):
///   switch C (pci0000:30, root port 30:01.0): GPU3, mlx5_2
///   root port 30:02.0 of the same host bridge: GPU4         → mlx5_2 through the host bridge
/// and rxe0 over eth0, which is never chosen while there are hardware NICs. Cores come from
/// `core_id`/`physical_package_id` (no `thread_siblings_list`).
pub fn mixed() -> Fixture {
    let f = Fixture::new("mixed");
    let a = |down: &str| ["0000:10:01.0".to_string(), "0000:11:00.0".to_string(), format!("0000:12:{down}")];
    for (down, bdf, ids) in [
        ("00.0", "0000:13:00.0", &H100),
        ("01.0", "0000:14:00.0", &H100),
        ("02.0", "0000:15:00.0", &CX7),
        ("03.0", "0000:16:00.0", &CX7),
    ] {
        let b = a(down);
        let pci = Pci { host: "pci0000:10", bridges: &[&b[0], &b[1], &b[2]], bdf };
        f.pci(&pci, ids, 0);
        if ids.driver == "mlx5_core" {
            let i = if down == "02.0" { 0 } else { 1 };
            f.ib(&format!("mlx5_{i}"), &pci, Some(&format!("ens{i}")), &[NDR]);
        }
    }
    f.pci(
        &Pci {
            host: "pci0000:20",
            bridges: &["0000:20:01.0", "0000:21:00.0", "0000:22:00.0"],
            bdf: "0000:23:00.0",
        },
        &H100,
        0,
    );
    let c = ["0000:30:01.0", "0000:31:00.0"];
    f.pci(&Pci { host: "pci0000:30", bridges: &[c[0], c[1], "0000:32:00.0"], bdf: "0000:33:00.0" }, &H100, 1);
    let nic = Pci { host: "pci0000:30", bridges: &[c[0], c[1], "0000:32:01.0"], bdf: "0000:35:00.0" };
    f.pci(&nic, &CX7, 1);
    f.ib("mlx5_2", &nic, Some("ens2"), &[("1: DOWN", "Ethernet", "200 Gb/sec (2X NDR)")]);
    f.pci(&Pci { host: "pci0000:30", bridges: &["0000:30:02.0"], bdf: "0000:38:00.0" }, &H100, 1);
    f.rxe("rxe0", "eth0");
    f.node(0, "0-3,8-11");
    f.node(1, "4-7,12-15");
    f.write("sys/devices/system/cpu/online", "0-15");
    for cpu in 0..16 {
        let t = format!("sys/devices/system/cpu/cpu{cpu}/topology");
        f.write(&format!("{t}/core_id"), &(cpu % 8).to_string());
        f.write(&format!("{t}/physical_package_id"), &((cpu % 8) / 4).to_string());
    }
    f
}

/// The CI VM with one H100 passed through and still no RDMA device: no
/// `/sys/class/infiniband` at all.
pub fn gpu_without_rdma_nic() -> Fixture {
    let f = ci_vm();
    f.pci(&Pci { host: "pci0000:00", bridges: &[], bdf: "0000:00:06.0" }, &H100, -1);
    f
}

/// A machine with a Soft-RoCE device and nothing else RDMA; with or without one GPU.
pub fn rxe_only(with_gpu: bool) -> Fixture {
    let f = ci_vm();
    f.rxe("rxe0", "enp0s3");
    if with_gpu {
        f.pci(&Pci { host: "pci0000:00", bridges: &[], bdf: "0000:00:06.0" }, &H100, -1);
    }
    f
}
