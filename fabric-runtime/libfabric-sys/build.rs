//! Probes libfabric >= 1.17 with pkg-config, compiles the C shim for the `static inline`
//! calls, and runs bindgen over the public headers plus the shim's header.

use std::env;
use std::path::PathBuf;

const MIN_VERSION: &str = "1.17";

fn main() {
    println!("cargo:rerun-if-changed=shim/shim.c");
    println!("cargo:rerun-if-changed=shim/shim.h");
    println!("cargo:rerun-if-changed=wrapper.h");

    let lib = match pkg_config::Config::new().atleast_version(MIN_VERSION).probe("libfabric") {
        Ok(lib) => lib,
        Err(e) => panic!(
            "\n\nfabric-libfabric-sys needs libfabric >= {MIN_VERSION} with its headers and a \
             pkg-config file, but the probe failed:\n  {e}\n\nOn Debian/Ubuntu install it with:\n  \
             apt-get install -y libfabric-dev pkg-config\n(and libclang-dev clang for bindgen). \
             If libfabric is installed elsewhere, point PKG_CONFIG_PATH at its libfabric.pc.\n\n"
        ),
    };

    let mut cc = cc::Build::new();
    cc.file("shim/shim.c").include("shim").warnings(true);
    for p in &lib.include_paths {
        cc.include(p);
    }
    cc.compile("fabric_shim");

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_arg("-Ishim")
        .allowlist_function("fi_.*")
        .allowlist_function("fabric_shim_.*")
        .allowlist_type("fi_.*")
        .allowlist_type("fid_.*")
        .allowlist_type("fid")
        .allowlist_var("FI_.*")
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true)
        .generate_comments(false)
        .prepend_enum_name(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for p in &lib.include_paths {
        builder = builder.clang_arg(format!("-I{}", p.display()));
    }
    let bindings =
        builder.generate().expect("bindgen failed on libfabric's headers (is libclang-dev installed?)");

    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings.write_to_file(out.join("bindings.rs")).expect("could not write bindings.rs");
}
