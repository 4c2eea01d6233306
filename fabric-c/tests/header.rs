//! `include/fabric.h` is what cbindgen makes of the crate now: a change to the API that
//! did not regenerate the header fails here. `FABRIC_BLESS=1 cargo test -p fabric-c --test
//! header` rewrites it.

use std::path::Path;

#[test]
fn header_matches_the_crate() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut made = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses the crate")
        .write(&mut made);
    let path = dir.join("include/fabric.h");
    if std::env::var_os("FABRIC_BLESS").is_some() {
        std::fs::write(&path, &made).expect("write include/fabric.h");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == made,
        "include/fabric.h differs from what cbindgen makes of fabric-c/src: regenerate it with \
         FABRIC_BLESS=1 cargo test -p fabric-c --test header, and commit it with the change"
    );
}
