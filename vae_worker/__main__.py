from vae_worker.service import main

main()
